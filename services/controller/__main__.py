"""`python -m kvmesh.services.controller ...`: `kvmesh serve controller` without the rest
of the CLI (which imports torch for its other commands)."""

from kvmesh.services.cli.controller_cmd import controller

if __name__ == "__main__":
    controller(prog_name="kvmesh serve controller")
