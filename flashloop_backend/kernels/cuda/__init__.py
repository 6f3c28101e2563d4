"""CUDA C++ kernels built on first use with NVRTC (``loader``): no compiler or extension
build on the host, only the driver and NVRTC libraries a CUDA build of torch loads."""
