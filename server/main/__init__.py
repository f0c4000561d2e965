"""The composition root, on top of every other layer: the `encoderd` command (cli.py, its flags and
their environment variables, the checked configuration), the gRPC app that builds and runs the
services (app.py) and the in-process API (inprocess.py, `import encoderd`). Nothing below imports it."""
