"""Filter stacks over a target."""
