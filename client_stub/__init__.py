"""Client stubs: the Python driver-API client and the native stub sources."""
