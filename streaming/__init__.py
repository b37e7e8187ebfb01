"""fishgate's engine: the worker thread that owns the model, continuous batching, chunked vocoder streams, text
segmentation and audio encoding. Only `streaming.backend` imports `model/`."""
