"""Worker side of encoderd: one process per (model, device) running a backend.

`protocol` and `model_spec` are the contract shared with the frontend and
import neither torch nor any backend library.
"""
