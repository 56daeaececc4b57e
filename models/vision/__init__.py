"""Vision towers and projectors of the vision-language ports, and what each family tells the engine about its images
(models/vision/common.py: VisionSpec, EncoderItem, the family's ImageAdapter)."""
