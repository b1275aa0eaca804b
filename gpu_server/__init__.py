"""The phos GPU server: front end, context workers and backends."""
