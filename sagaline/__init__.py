"""Sagaline: recoverable side effects for AI-agent tool calls, over Kafka."""
