"""MLflow tracking of training runs: store set-up, batched logging, a local spool for outages."""
