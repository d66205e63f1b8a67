"""`python -m kvmesh.services.lookup ...`: `kvmesh serve lookup` without the rest of the
CLI."""

from kvmesh.services.cli.lookup_cmd import lookup

if __name__ == "__main__":
    lookup(prog_name="kvmesh serve lookup")
