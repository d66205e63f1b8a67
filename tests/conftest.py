"""Suite-wide setup: tests/ is on sys.path (this file's folder), so the shared helpers
in tests/kvtest/ import as `kvtest`."""
