"""Model parallelism: tensor parallelism applied to a built model (`tp.apply_tp`)."""
