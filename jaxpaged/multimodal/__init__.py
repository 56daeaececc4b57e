"""Images in prompts (vision-language models): reading and processing them (processing.py, media.py), a request's
placed images (inputs.py), the encoder cache and the scheduling of encoder work (encoder_cache.py), and the device
side, the compiled encoder steps and each step's per-token image rows (runner.py). docs/design.md, "Images"."""
