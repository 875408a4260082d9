"""The core: configuration, the samplers, augmentation, the planner's policy, the pure half of
hybrid decode (the dataset index is ``prefetchd.sources``'s; the bar its scan draws is here). Functions of their inputs,
testable without processes. Imports only ``prefetchd.format`` and itself."""
