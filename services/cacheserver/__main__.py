"""`python -m kvmesh.services.cacheserver ...`: `kvmesh serve cacheserver` without the rest
of the CLI (which imports torch for its other commands)."""

from kvmesh.services.cli.cacheserver_cmd import cacheserver

if __name__ == "__main__":
    cacheserver(prog_name="kvmesh serve cacheserver")
