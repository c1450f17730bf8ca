"""The serving layer: one generation request from admission to release."""
