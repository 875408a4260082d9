"""Augmentation: how one sample's pixels are made from its file's bytes. Pure.

One room per way a sample is made, all seeded from the sample's key in ``seeds``:

* ``modes``: the built-in recipes (``augment.mode``: scale, random_resized_crop, eval; flip,
  colour jitter, lighting) on uint8 arrays, with libjpeg-turbo's DCT scaling and OpenCV;
* ``transform``: a user's own transform (``augment.transform``), run in the workers;
* ``seeds``: the per-sample seeding every one of them uses, so a sample's pixels are a pure
  function of ``(seed, epoch, sample)`` whatever the worker, the restart or the resume.

Importing this package imports none of them (the client imports ``seeds`` alone, never the
decoders: Pillow, OpenCV and simplejpeg stay out of the trainer).
"""
