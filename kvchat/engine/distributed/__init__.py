"""One model over several ranks: rank 0 drives a Session and the followers replay its operations on their shards."""
