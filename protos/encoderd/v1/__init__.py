"""Generated encoderd.v1 API modules (see protos/generate.py)."""
