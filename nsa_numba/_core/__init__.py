"""The runtime every layer uses: errors, configuration, the Numba options, kernel
launches, caches, the output pool."""
