"""The compiled kernels and the helpers they inline."""
