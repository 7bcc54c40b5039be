"""Draft service: runs the EAGLE-3 draft head and builds candidate trees."""
