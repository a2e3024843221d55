"""Train state, optimizer, the fused train step and the loop."""
