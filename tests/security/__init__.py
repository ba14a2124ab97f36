"""Who may do what: unprivileged devices, what root trusts, /run/aioublk."""
