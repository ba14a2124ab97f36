"""The C sources as C: each file alone, pkg-config's paths, ASan and UBSan."""
