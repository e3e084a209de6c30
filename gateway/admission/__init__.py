"""SLO tiers and API keys, admission and capacity, rate limits, the limits gateway replicas
share through Redis, and refusals."""
