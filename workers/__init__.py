"""Worker side of encoderd: one process per (model, device) running a backend.

`contract` is what the frontend shares with the workers, and the only part of this package
the frontend imports; it imports neither torch nor any backend library.
"""
