"""Stand-ins for hosts that cannot run here, each faithful to the public
shape it imitates and labelled as such."""
