"""Storage tiers behind one interface: L1 host memory now; disk, remote, P2P later."""
