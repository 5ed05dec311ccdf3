"""PyTorch integration and the command line: the only package that imports torch."""
