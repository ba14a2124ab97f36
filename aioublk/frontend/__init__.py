"""What a user runs: the kublk-compatible CLI (a module per verb in
``verbs/``), ``serve config.toml``, the config file, the target registry,
and what serving shows the outside (run directory records, metrics, udev
rules, sd_notify)."""
