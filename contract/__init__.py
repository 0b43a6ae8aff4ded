"""Types that more than one component reads, kept here because components never import each other."""
