"""Fleet autoscaler: a sans-IO decision core (decision.py, offers.py), providers, and the router's loop."""
