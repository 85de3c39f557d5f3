"""What every run shares: session, loop, jitted step, optimiser, packing, setup."""
