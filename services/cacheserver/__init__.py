"""The cache-server: the shared remote tier (`kvmesh serve cacheserver`)."""
