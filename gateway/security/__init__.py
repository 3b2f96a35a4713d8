"""Tenants, API keys, authentication and per-tenant KV-cache isolation."""
