"""The controller: cluster registry, membership, P2P lookups and admin fan-out."""
