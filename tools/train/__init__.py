"""Training EAGLE-3 draft heads by self-distillation from the project's own target engine."""
