"""Steps shared by every recipe (loss, forward/backward, optimizer step, metrics) and the SFT loop."""
