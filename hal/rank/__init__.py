"""What a rank process does to itself: take its name (``name``), and leave in the safe order (``exit``)."""
