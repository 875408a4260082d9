"""The core: configuration, the samplers, augmentation, the planner's policy, the pure half of
hybrid decode, and the dataset index (with the bar its scan draws). Functions of their inputs,
testable without processes. Imports only ``prefetchd.format`` and itself."""
