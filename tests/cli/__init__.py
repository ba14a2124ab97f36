"""The command line: parser, completions, start-up cost, records, kublk's scripts."""
