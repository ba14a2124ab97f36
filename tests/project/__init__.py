"""The project as shipped: package, docs, import layers, lint."""
