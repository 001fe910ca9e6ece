"""Operations: launching and supervising processes (pdserve up)."""
