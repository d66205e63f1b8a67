"""The lookup-server: cached-prefix answers for schedulers (per instance) and routers."""
