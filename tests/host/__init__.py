"""Host tests: no ublk driver needed; they run wherever pytest runs."""
