"""What a node shows: the HTTP status API and metrics (`http`), the swarm history the dashboard draws
(`swarm_view`), and the `node status` command (`command`)."""
