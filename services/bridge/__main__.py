"""`python -m kvmesh.services.bridge ...`: `kvmesh serve bridge` without the rest of the
CLI (which imports torch for its other commands)."""

from kvmesh.services.cli.bridge_cmd import bridge

if __name__ == "__main__":
    bridge(prog_name="kvmesh serve bridge")
