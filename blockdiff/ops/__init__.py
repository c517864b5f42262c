"""Device kernels below the model and the sampler: the Triton kernels that CUDA runs in place of
the reference (CPU) computations, each beside the reference it must match. Nothing here imports
triton at import time of the package: a backend that needs it imports its module when chosen."""
