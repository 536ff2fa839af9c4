"""Images for vision-language models, in small pieces with one job each: decoding what a client
sends (decode.py) within the server's limits (limits.py), the family's HF image processor
(processor.py: CLIP's for LLaVA, Qwen2VL's for Qwen2.5-VL), a content hash per image and the
pseudo token ids it gives the image's placeholders (hashing.py), placeholder expansion
(placeholders.py), the intake's use of all of them (inputs.py), and the encoder cache of vision
features (encoder_cache.py). See docs/multimodal.md."""
