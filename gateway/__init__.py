"""One router replica: its composition root, fleet, HTTP server, planner, proxy, admin API and mesh link."""
