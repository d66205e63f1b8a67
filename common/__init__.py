"""What every kvmesh process shares."""
