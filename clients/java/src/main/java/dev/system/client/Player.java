package dev.system.client;

import java.util.Objects;

/**
 * A player on this game server, as the JOIN presence announces them.
 *
 * @param id stable id (a UUID string for Minecraft)
 * @param name display name
 * @param language client language ({@code zh_cn}, {@code en_us}, or {@code zh}, {@code en})
 * @param permissionLevel operator level, 0 to 4
 */
public record Player(String id, String name, String language, int permissionLevel) {
  public Player {
    Objects.requireNonNull(id);
    name = name == null ? "" : name;
    language = language == null ? "en_us" : language;
    if (permissionLevel < 0 || permissionLevel > 4) {
      throw new IllegalArgumentException("permissionLevel must be 0 to 4");
    }
  }
}
