"""What joins the engine and the store for the front ends: the live sessions of a process
(``pool``), a session made, loaded and saved on one machine or on every rank
(``sessions``), and a sharded run's files and follower ranks (``sharded``). No Textual."""
