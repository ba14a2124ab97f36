"""null, loop and stripe, and what every target owes: durability, options."""
