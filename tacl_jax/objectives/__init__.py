"""Pure functions: masking, the MLM loss, TaCL's token contrastive loss and their combination."""

from tacl_jax.objectives.combined import objective_sums, ratios, total_loss
from tacl_jax.objectives.contrastive import (token_contrastive_at, token_contrastive_loss,
                                            token_contrastive_per_token)
from tacl_jax.objectives.masking import Masked, mask_tokens, num_predictions, selection_count
from tacl_jax.objectives.mlm import mlm_loss, mlm_per_position

__all__ = ["Masked", "mask_tokens", "num_predictions", "selection_count", "mlm_loss", "mlm_per_position",
           "token_contrastive_at", "token_contrastive_loss", "token_contrastive_per_token",
           "objective_sums", "ratios", "total_loss"]
